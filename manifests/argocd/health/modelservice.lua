-- Argo CD health check for tokenlane.dev/ModelService (resource.customizations.health).
-- Reads only what the operator writes to status: observedGeneration and the conditions
-- Ready, Progressing, Degraded and RolledBack. Degraded only when the operator says so.
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

-- A rolled-back revision keeps the user's spec but runs the last-known-good configuration:
-- the spec in Git is not what serves, so the application is not healthy until it is fixed.
local rolledBack = condition("RolledBack")
if rolledBack ~= nil and rolledBack.status == "True" then
  hs.status = "Degraded"
  hs.message = "Rolled back to the last-known-good revision: " .. explain(rolledBack, "RolledBack")
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
  local replicas = obj.status.replicas
  local readyReplicas = obj.status.readyReplicas or 0
  if replicas ~= nil then
    hs.message = tostring(readyReplicas) .. "/" .. tostring(replicas) .. " replicas ready"
  else
    hs.message = explain(ready, "Ready")
  end
  return hs
end

-- Scaled to zero on purpose (spec.replicas: 0, e.g. by an autoscaler): nothing to wait for.
if ready ~= nil and ready.reason == "ScaledToZero" then
  hs.status = "Healthy"
  hs.message = explain(ready, "ScaledToZero")
  return hs
end

-- Not ready yet and the operator reports no failure: pods are starting (the operator sets
-- Degraded when its progress deadline passes).
hs.status = "Progressing"
hs.message = explain(ready, "Waiting for the runtime pods to become ready")
return hs
