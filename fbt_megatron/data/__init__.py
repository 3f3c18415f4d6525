"""Training data for a recipe that is not the data pipeline's (``data_pipeline/``): the synthetic stream
(:mod:`.synthetic`)."""
