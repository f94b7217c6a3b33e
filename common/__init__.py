"""The ground floor: the torch-free vocabulary that router/, replica/, cluster/ and bench/ all stand on.

    page_keys       the one identity of a page of KV (hash chain, versioned)
    events          KV events a replica publishes (stored / removed / cleared)
    routing_stats   the routing-stats wire format: encoder and parser together
    page_format     what a page at rest must match, and the KV dtype table
    types           requests, sampling parameters, streamed outputs, stats, cache sources
    errors          the errors that cross process boundaries, classified by type

Nothing here imports torch, Ray or any other layer of prefixserve.
"""
