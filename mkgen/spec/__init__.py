"""The model spec language, its loaders, derived figures, mini twins and topologies."""

from mkgen.spec.files import spec_from_dict
from mkgen.spec.loader import load_spec
from mkgen.spec.schema import ModelSpec
from mkgen.spec.topology import Topology, parse_topology

__all__ = ["ModelSpec", "Topology", "load_spec", "parse_topology", "spec_from_dict"]
