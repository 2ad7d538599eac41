"""torch.distributed building blocks, with no Lightning in them."""
