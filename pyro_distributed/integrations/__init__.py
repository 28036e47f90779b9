"""Integrations with the frameworks that train Pyro models: Lightning and scvi-tools.

Each subpackage is imported on its own and only when asked for:
``import pyro_distributed`` imports neither, and neither imports the other's
framework for it. :mod:`.lightning` is the strategy, the one place that
imports Lightning. :mod:`.scvi` adapts scvi-tools' objects (its loaders, its
Pyro plans' guides, its posteriors, AnnData on disk) and never imports
scvi-tools itself: it works on the objects a user's scvi-tools model hands
it, and the strategy calls it when it meets them.
"""
