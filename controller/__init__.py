"""moeless.controller: the control plane: the knobs a policy sets, the planning loop (pure rules and
their Ray shell), the expert-host pool as serving follows it, and the Kubernetes operator."""
