"""Message protocols: one module of frozen, tagged msgspec Structs per actor, plus the codec."""
