-- Argo CD health check for tokenlane.dev/ServingLane (resource.customizations.health).
-- Reads only what the operator writes to status: observedGeneration and the conditions
-- Ready, Progressing, Degraded and RolledBack. Degraded only when the operator says so
-- (e.g. its ModelService does not exist, or its budgets were rolled back). SLOMet=False is
-- an alerting matter (manifests/monitoring), not a sync health one: it shows in the message.
local hs = {}

local function condition(name)
  if obj.status == nil or obj.status.conditions == nil then
    return nil
  end
  for _, c in ipairs(obj.status.conditions) do
    if c.type == name then
      return c
    end
  end
  return nil
end

local function explain(c, fallback)
  local text = fallback
  if c ~= nil and c.reason ~= nil and c.reason ~= "" then
    text = c.reason
  end
  if c ~= nil and c.message ~= nil and c.message ~= "" then
    text = text .. ": " .. c.message
  end
  return text
end

if obj.status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to reconcile"
  return hs
end

local generation = obj.metadata.generation
local observed = obj.status.observedGeneration
if generation ~= nil and (observed == nil or observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end

local degraded = condition("Degraded")
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = explain(degraded, "Degraded")
  return hs
end

local rolledBack = condition("RolledBack")
if rolledBack ~= nil and rolledBack.status == "True" then
  hs.status = "Degraded"
  hs.message = "Rolled back to the last-known-good budgets: " .. explain(rolledBack, "RolledBack")
  return hs
end

local progressing = condition("Progressing")
if progressing ~= nil and progressing.status == "True" then
  hs.status = "Progressing"
  hs.message = explain(progressing, "Progressing")
  return hs
end

local ready = condition("Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = explain(ready, "Ready")
  local slo = condition("SLOMet")
  if slo ~= nil and slo.status == "False" then
    hs.message = hs.message .. " (SLO missed: " .. explain(slo, "SLOMet") .. ")"
  end
  return hs
end

hs.status = "Progressing"
hs.message = explain(ready, "Waiting for the lane to be served")
return hs
