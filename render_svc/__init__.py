"""The one-call render service: durable jobs, stage batching across clients, a read-only web page."""
