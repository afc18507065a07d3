"""moeless.controller.operator: the Kubernetes operator of ExpertAutoscalingPolicy (moeless.io/v1alpha1,
short name eap): a level-triggered reconcile that sizes the expert-host pool and reports GB·s.

Pure parts: spec (parse and check a policy), scaling (how many hosts), meters (read the hosts'
/metrics), objects (what a policy owns), reconcile (policy + observed -> actions), leader.lease_step.
Shell: kube (reads and writes), leader.LeaderElector, loop.Operator, cli (`moeless operator`).
Manifests and chart: manifests/, helm/moeless; guide: docs/kubernetes.md.
"""
