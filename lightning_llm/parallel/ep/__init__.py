"""Expert parallelism: whole experts per rank, tokens moved to them and back by all-to-all (see :mod:`.style`)."""
