"""Packed training rows (`trainer.pack`): the kept sequences of a step placed into R rows of L
tokens on the host (`pack`), the device side of those rows and their log-probs (`rows`), and how
many rows a run gets (`plan`, `trainer.pack_rows=auto`).

May import: algo, models, data, parallel, config.
"""
