"""unet-amp: the machinery under train_unet.py, one module per concern."""
