"""The embedded JAX sampler, the rollout engine where no server runs: sampling parameters and
token choice (`sampling`), the completion cache's segments and compaction buckets (`segments`, host
arithmetic shared with the memory plan), and the sampler itself (`sampler`: one prompt prefill per
question, batched KV-cache decode).

May import: models, parallel, observe.
"""
