"""moeless.twin: the digital twin: serving iterations replayed through any planner on a modelled cluster, every cost counted."""
