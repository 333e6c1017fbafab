"""Numeric parity of exported models with Keras: the judging rules
(`rules`), the report (`report`), the engine the checks share with their
argument checks (`engine`), the runtimes' runs (`runner`) and a float
model's float64 second reference (`exact`)."""
