"""The arrangement study: is the tilt of a pair of identical discs, a relation between distant positions, read by a
local view? (README.md; its command: ``python -m studies.arrangement``)"""
