"""moeless.controller.planning: the planning loop: its pure rules (rules, window, cost_fit) and their
Ray shell (actor: one plan for every serving replica; board: publishing it; metrics)."""
