"""The algorithm, as pure functions in static shapes: group advantages and CPPO's pruning (`cppo`),
the selection rules that followed it (`selection`), DPPO's unbiased pruning (`dppo`), token
log-probs and the clipped policy loss (`loss`), and where a step's old-policy and behaviour log-probs
come from (`logp_sources`). Nothing here holds state or runs a loop: `train/` composes these into
the step's compiled program.

May import: models, data, parallel, config.
"""
