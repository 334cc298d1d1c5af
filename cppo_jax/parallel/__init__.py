"""Devices: the mesh and the one rules table mapping logical axis names onto it (`sharding`), and
several processes as one run through `jax.distributed` (`distributed`).

May import: config.
"""
