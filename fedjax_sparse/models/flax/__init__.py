"""The Flax adapter: any ``flax.linen`` / ``flax.nnx`` module as a ``Model`` (``adapter.from_flax``), with
what it reads from the module's own program (``program_flow``) and the probes that verify its
normalisation and padding (``probes``). Importing this package imports none of its modules."""
