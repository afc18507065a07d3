"""Where a host's weights come from: the tiers (disk -> host memory -> device) and several models'
weight stores behind one host."""
