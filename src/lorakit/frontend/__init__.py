"""Where the engine meets its users: the engine loop's homes (a thread: ``AsyncEngine``; a process: the engine
core), the clients a server talks to them through (``EngineClient``), the wire between processes, and the streams
that give outputs their text."""
