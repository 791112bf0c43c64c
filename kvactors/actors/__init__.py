"""kvactors.actors: the actor shells of one device (gather, streams, IPC owners)."""
