"""The pure floor: buffers (DLPack views), chunk bounds and ring indices, reduce ops,
errors and the alpha-beta cost model. Nothing here talks to another rank."""
