"""Training: the LightningModule, the command line, checkpoints, run folders, loggers and callbacks."""
