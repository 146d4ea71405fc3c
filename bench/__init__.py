"""Load generator, simulated executor and report (`tokenlane bench`, `tokenlane demo`)."""
