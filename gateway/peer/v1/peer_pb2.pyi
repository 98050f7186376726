from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Header(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class AbortHeldRequest(_message.Message):
    __slots__ = ("service", "request", "principal", "headers")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    PRINCIPAL_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    service: str
    request: bytes
    principal: str
    headers: _containers.RepeatedCompositeFieldContainer[Header]
    def __init__(self, service: _Optional[str] = ..., request: _Optional[bytes] = ..., principal: _Optional[str] = ..., headers: _Optional[_Iterable[_Union[Header, _Mapping]]] = ...) -> None: ...

class AbortHeldResponse(_message.Message):
    __slots__ = ("held", "response")
    HELD_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    held: bool
    response: bytes
    def __init__(self, held: _Optional[bool] = ..., response: _Optional[bytes] = ...) -> None: ...

class MetricsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MetricsResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class DiscoveredHost(_message.Message):
    __slots__ = ("url", "origin", "in_service")
    URL_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    IN_SERVICE_FIELD_NUMBER: _ClassVar[int]
    url: str
    origin: str
    in_service: bool
    def __init__(self, url: _Optional[str] = ..., origin: _Optional[str] = ..., in_service: _Optional[bool] = ...) -> None: ...

class DiscoveredRequest(_message.Message):
    __slots__ = ("source", "hosts")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    source: str
    hosts: _containers.RepeatedCompositeFieldContainer[DiscoveredHost]
    def __init__(self, source: _Optional[str] = ..., hosts: _Optional[_Iterable[_Union[DiscoveredHost, _Mapping]]] = ...) -> None: ...

class DiscoveredResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
