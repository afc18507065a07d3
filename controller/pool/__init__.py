"""moeless.controller.pool: the expert-host pool as its users see it: its members and their clients,
where they are listed (fixed, a file, the operator's pods), and waking a pool scaled to zero."""
