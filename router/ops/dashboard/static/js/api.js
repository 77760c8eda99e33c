// Calls to the router's JSON API with the keys the operator typed. The keys live in this
// tab's sessionStorage at most (never a cookie, never in a URL) and travel only in the
// Authorization header, to this origin.

const API_KEY = "pdserve.apiKey";
const ADMIN_KEY = "pdserve.adminKey";

export const keys = {
  api: sessionStorage.getItem(API_KEY) || "",
  admin: sessionStorage.getItem(ADMIN_KEY) || "",
};

export function setKeys(api, admin) {
  keys.api = api;
  keys.admin = admin;
  for (const [name, value] of [[API_KEY, api], [ADMIN_KEY, admin]]) {
    if (value) sessionStorage.setItem(name, value);
    else sessionStorage.removeItem(name);
  }
}

export class HttpError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

const TIMEOUT_MS = 10000; // every wait bounded

async function call(method, path, { admin = false, body } = {}) {
  const headers = { Accept: "application/json" };
  const key = admin ? keys.admin || keys.api : keys.api;
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  const response = await fetch(path, {
    method, headers, body: body === undefined ? undefined : JSON.stringify(body),
    credentials: "omit", cache: "no-store", signal: AbortSignal.timeout(TIMEOUT_MS),
  });
  const text = await response.text();
  let data = null;
  try { data = text ? JSON.parse(text) : null; } catch { data = null; }
  if (!response.ok) {
    const message = data && data.error ? data.error.message : `${response.status} ${response.statusText}`;
    throw new HttpError(response.status, message);
  }
  return data;
}

export const getJSON = (path) => call("GET", path);
export const scaleRole = (role, replicas) =>
  call("PUT", `/v1/roles/${encodeURIComponent(role)}`, { admin: true, body: { replicas } });
export const drainWorker = (workerId) =>
  call("POST", `/v1/workers/${encodeURIComponent(workerId)}/drain`, { admin: true });
