"""mkgen: declarative MoE model spec + TPU topology -> Pallas decode megakernel."""

__version__ = "0.1.0"
