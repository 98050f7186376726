"""KV-cache awareness: which worker holds which prompt prefix, learned from the workers'
own KV events (or, without them, from the gateway's own placements)."""
