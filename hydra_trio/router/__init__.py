"""Router mode: many models behind one node, each served by a supervised child node, as llama-server's router
(docs/router.md): :mod:`.presets` and :mod:`.ini` read the models, :mod:`.models` runs their children,
:mod:`.app` and :mod:`.proxy` answer and relay HTTP, :mod:`.server` puts them on a port."""
