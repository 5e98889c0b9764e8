"""Building blocks shared by the models: norm, rotary, linear (and the attention dispatch).

Import from the submodules (``prefill_server.layers.norm`` ...); this package imports nothing
eagerly so that importing one layer never drags in another's dependencies."""
