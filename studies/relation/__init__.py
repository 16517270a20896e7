"""The relation study: does a CNN's local view miss a relation between distant parts? (README.md)

Run it with ``python -m studies.relation --config studies/relation/configs/relation.yaml`` (``__main__``).
"""
