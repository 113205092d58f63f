"""What the data-parallel tests send (``test_data_parallel``, ``test_ray_serve``): a shared
system prompt longer than a few KV blocks, and a small answer schema."""

SYSTEM = "You are the assistant of a shop that sells bicycles, helmets and lights; answer briefly. " * 2
SCHEMA = {
    "type": "object",
    "properties": {"item": {"type": "string", "maxLength": 8}, "count": {"type": "integer"}},
    "required": ["item", "count"],
    "additionalProperties": False,
}
