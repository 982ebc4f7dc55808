"""The consumer, in parts: the loop's bookkeeping and the path of a message."""
