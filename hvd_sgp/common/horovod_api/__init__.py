"""Horovod's API on the core: collectives, process sets, join and Horovod's Compressor
interface. Kept apart from the SGP algorithm, which never goes through it."""
