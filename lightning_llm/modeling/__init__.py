"""Reading a user's model: where its transformer blocks are, its shape for FLOP accounting, and the
activation bytes its blocks keep (measured on fake tensors). Nothing here changes the model."""
