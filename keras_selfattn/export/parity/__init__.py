"""Numeric parity of exported models with Keras: the judging rules
(`rules`), the report (`report`), the engine the checks share (`engine`)
and their argument checks (`arguments`)."""
