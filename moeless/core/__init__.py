"""moeless.core: what every package shares and nothing else: where the cache lives, how many
threads torch uses, one JSON file read with its failures named, repeated calls timed."""
