"""aerie-spec: train and serve EAGLE-3 / EAGLE-3.1 speculative-decoding drafters on Ray."""

__version__ = "0.1.0"
