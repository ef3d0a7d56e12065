"""`eagleserve bench serve` (vLLM's `vllm bench serve`): drive a running server with a data set at
a request rate and report throughput, latency percentiles and, under speculation, the tokens per
verify step and the acceptance by draft depth. A client only: it speaks HTTP to the server."""
