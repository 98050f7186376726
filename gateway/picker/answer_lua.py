"""The Lua that Envoy runs on the answers of the Generates the picker placed (`gateway
envoy-config`'s `envoy.filters.http.lua`), so the picker learns their usage without
sitting in their path: Envoy keeps the answer's last message (or each one, as the
picker's mark says) while it relays the answer, and hands it over on the trailers, which
the picker reads anyway (`usage`).

The mark is the `gateway.picker` dynamic metadata of the picker's answer: `answer` is
`last` (one choice's running totals: its last message says all) or `all` (each message
counts its own tokens, or several choices interleave). Unmarked calls pass untouched.
The response body is cut into gRPC frames as its chunks come, split anywhere: only whole
uncompressed frames are kept, at most MAX_BYTES together, a longer one stepped over
without copying it; in `last` mode a new frame drops the one before it as it begins. At
the trailers, the frames kept (prefixes included) go in `TRAILER`, base64, replacing any
the worker sent; none if the last frame (in `all` mode: any frame) could not be kept, or
the body is no gRPC framing. The picker removes the trailer before the client sees it."""

from __future__ import annotations

from gateway.picker.wire import PICKER_NAMESPACE

TRAILER = "x-gateway-answer-bin"
MARK_KEY = "answer"  # in the `gateway.picker` metadata: `last` or `all`
MAX_BYTES = 48 * 1024  # base64 in the trailer: within the picker's 96 KiB for headers

SOURCE = f"""\
local MAX = {MAX_BYTES}
local TRAILER = "{TRAILER}"

function envoy_on_response(handle)
  local mark = handle:streamInfo():dynamicMetadata():get("{PICKER_NAMESPACE}")
  local mode = mark and mark["{MARK_KEY}"]
  if mode ~= "last" and mode ~= "all" then
    return
  end
  local every = mode == "all"
  local kept, size = {{}}, 0  -- whole frames kept, their bytes
  local head, left = "", 0  -- a prefix cut short; bytes of the frame to come
  local parts = nil  -- the frame being kept, if it is
  local known = true  -- false: what the picker needs cannot be kept
  for chunk in handle:bodyChunks() do
    local n, at = chunk:length(), 0
    while known and at < n do
      if left > 0 then
        local take = math.min(left, n - at)
        if parts then
          parts[#parts + 1] = chunk:getBytes(at, take)
        end
        at, left = at + take, left - take
        if left == 0 and parts then
          local frame = table.concat(parts)
          kept[#kept + 1], size, parts = frame, size + #frame, nil
        end
      else
        local need = math.min(5 - #head, n - at)
        head, at = head .. chunk:getBytes(at, need), at + need
        if #head == 5 then
          local flag, a, b, c, d = string.byte(head, 1, 5)
          left = ((a * 256 + b) * 256 + c) * 256 + d
          if not every then
            kept, size = {{}}, 0
          end
          if flag == 0 and size + 5 + left <= MAX then
            parts = {{head}}
            if left == 0 then
              kept[#kept + 1], size, parts = head, size + 5, nil
            end
          elseif flag > 1 or every then
            known, kept = false, {{}}
          end
          head = ""
        end
      end
    end
  end
  local trailers = handle:trailers()
  if trailers == nil then
    return
  end
  trailers:remove(TRAILER)
  if known and left == 0 and head == "" and #kept > 0 then
    trailers:add(TRAILER, handle:base64Escape(table.concat(kept)))
  end
end
"""
