"""TileOPs in other libraries' models.

``tileops.integrations.transformers`` patches a Hugging Face transformers model in one call:
``apply(model)`` replaces the modules TileOPs has ops for and returns a report of what it
replaced and what it left. The integrations import their library only where they need it; the
ops and modules (``tileops.ops``, ``tileops.nn``) never import them.
"""
