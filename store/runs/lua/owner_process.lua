-- The process of an owner id "<process>/<attempt>" (store.runs.owner_process), or nil.
-- Prepended to the scripts that use it (claim.lua, orphaned.lua).
local function owner_process(owner)
  local process = string.match(owner, '^(.+)/[^/]+$')
  return process
end
