"""scvi-tools and AnnData with local parameters owned by their worker."""
