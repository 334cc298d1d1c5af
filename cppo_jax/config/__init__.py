"""The run configuration: the typed, frozen sections and their checks (`schema`, with the model's
sections in `model` and the run's in `run`), the allowed values of every choice key and the error
that names a wrong one (`choices`), and config files, dotted overrides and (de)serialisation
(`files`). Host code: imports no JAX, so every other folder can read a config.

May import: nothing of the package.
"""
