"""The pure core: formats and layouts, validated transfer plans, the plan cache, ordering
bookkeeping, pointer ranges, the LMCache plugin names and the message protocols.

Nothing here runs asyncio, owns a thread or touches device state; the floors above build on it.
"""
