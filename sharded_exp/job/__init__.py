"""A job as data: the spec the parent decides and the ranks receive (:mod:`.spec`), and the
result it ends with (:mod:`.result`, result.json's one writer and its schema)."""
