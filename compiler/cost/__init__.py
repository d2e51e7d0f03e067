"""The analytical performance and memory model: compute, communication, pipeline, memory."""
