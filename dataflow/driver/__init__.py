"""The driver side of a fit: a pure state machine (``machine``) fed by events
(``events``), asking for effects by commands (``commands``), carried out by the
only module that talks to Dask (``executor``) in a small loop (``loop``)."""
