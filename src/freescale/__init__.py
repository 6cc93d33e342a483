"""FreeScale: distributed training of sequence recommendation models at minimal scaling cost."""

__version__ = "0.1.0"
