"""The trainer <-> teacher records under their former name: they live in :mod:`services.protocol`
(names, records, end of data); import them from there."""

from services.protocol.names import (  # noqa: F401
    TEACHER_TASK,
    TRANSPORTS,
    hidden_field,
    new_instance,
    request_partition,
    result_field,
    trainer_task,
)
from services.protocol.teacher import (  # noqa: F401
    MAX_BLOB_BYTES,
    REQUEST_FIELDS,
    Request,
    Result,
    decode_request,
    hidden_column,
    hidden_from_column,
    pack_blob,
    request_fields,
    unpack_blob,
)
