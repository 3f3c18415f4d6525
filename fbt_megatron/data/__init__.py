"""Training data for a recipe: the data pipeline's token loaders (``data_pipeline/``) or the synthetic
stream (:mod:`.synthetic`), built for one data-parallel rank (:mod:`.loaders`)."""
