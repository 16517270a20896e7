"""The relation study: does a CNN's local view miss a relation between distant parts? (README.md)

Its grid runs through the shared runner: ``python -m studies.runner --config studies/relation/configs/relation.yaml``.
Its own code: the predictions written before the runs (``visibility``) and their post-hoc reading
(``posthoc_visibility``).
"""
