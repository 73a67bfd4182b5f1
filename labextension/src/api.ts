/**
 * The HTTP client of the sidebar: every call goes through Jupyter's ServerConnection, so the
 * browser's Jupyter session (cookie + XSRF, or the page's token) authenticates it and no LMSP
 * token is ever handled here. The Jupyter user is the service's owner (LMSP B3).
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import type {
  IClient,
  IClientList,
  IEventPage,
  IModelList,
  IPairing,
  IPairingList,
  IRegisteringTask,
  IService,
  ITask,
  ITaskList,
  IWebhookDelivery,
  IWebhookDeliveryList,
  IWebhookEndpoint,
  IWebhookEndpointCreated,
  IWebhookEndpointList,
  WebhookEventType
} from './types';

/** An answer other than 2xx, with the message of the LMSP error body when there is one. */
export class LMSPError extends Error {
  constructor(
    message: string,
    readonly status: number,
    readonly code: string | null = null
  ) {
    super(message);
    this.name = 'LMSPError';
  }
}

/** The LMSP error body's message, or the HTTP status text when the body is not one. */
export async function errorFrom(response: Response): Promise<LMSPError> {
  let message = `${response.status} ${response.statusText}`.trim();
  let code: string | null = null;
  try {
    const body = (await response.json()) as {
      error?: { message?: unknown; code?: unknown };
      message?: unknown;
    };
    const error = body.error;
    if (error && typeof error.message === 'string' && error.message) {
      message = error.message;
    } else if (typeof body.message === 'string' && body.message) {
      message = body.message;
    }
    if (error && typeof error.code === 'string') {
      code = error.code;
    }
  } catch {
    // not JSON: keep the status line
  }
  return new LMSPError(message, response.status, code);
}

export class LMSPClient {
  readonly settings: ServerConnection.ISettings;

  constructor(settings?: ServerConnection.ISettings) {
    this.settings = settings ?? ServerConnection.makeSettings();
  }

  /** The absolute URL of `lmsp/v1/<path>` under this server's base URL. */
  url(path: string, query?: Record<string, string | number>): string {
    const url = URLExt.join(this.settings.baseUrl, 'lmsp/v1', path);
    if (!query) {
      return url;
    }
    const params = new URLSearchParams();
    for (const [key, value] of Object.entries(query)) {
      params.set(key, String(value));
    }
    return `${url}?${params.toString()}`;
  }

  /** A raw request (for streams); the caller reads the body. */
  async fetch(path: string, init: RequestInit = {}): Promise<Response> {
    return ServerConnection.makeRequest(this.url(path), init, this.settings);
  }

  async request<T>(method: string, path: string, body?: unknown): Promise<T> {
    const init: RequestInit = { method, cache: 'no-store' };
    if (body !== undefined) {
      init.body = JSON.stringify(body);
      init.headers = { 'Content-Type': 'application/json' };
    }
    const response = await this.fetch(path, init);
    if (!response.ok) {
      throw await errorFrom(response);
    }
    return (await response.json()) as T;
  }

  service(): Promise<IService> {
    return this.request('GET', 'service');
  }

  /** Tasks newest first; `after`: the last task id of the previous page. */
  tasks(limit = 20, after?: string): Promise<ITaskList> {
    const query = after ? `&after=${encodeURIComponent(after)}` : '';
    return this.request('GET', `tasks?limit=${limit}${query}`);
  }

  task(id: string): Promise<ITask> {
    return this.request('GET', `tasks/${encodeURIComponent(id)}`);
  }

  cancelTask(id: string): Promise<ITask> {
    return this.request('POST', `tasks/${encodeURIComponent(id)}/cancel`, {});
  }

  /** A JSON page of a task's events after sequence number `after` (the poll fallback). */
  events(id: string, after: number, limit = 1000): Promise<IEventPage> {
    return this.request(
      'GET',
      `tasks/${encodeURIComponent(id)}/events?after=${after}&limit=${limit}`
    );
  }

  /** The Prometheus metrics (GET /lmsp/v1/metrics, text): the owner holds `metrics:read`. */
  async metrics(): Promise<string> {
    const response = await this.fetch('metrics', { cache: 'no-store' });
    if (!response.ok) {
      throw await errorFrom(response);
    }
    return response.text();
  }

  models(): Promise<IModelList> {
    return this.request('GET', 'models');
  }

  /** Register a model from a local path (LMSP B4): answers `202` with the registering task. */
  registerModel(source: string): Promise<IRegisteringTask> {
    return this.request('POST', 'models', { source });
  }

  pairings(): Promise<IPairingList> {
    return this.request('GET', 'pairings');
  }

  approvePairing(id: string, scopes?: string[]): Promise<IPairing> {
    return this.request(
      'POST',
      `pairings/${encodeURIComponent(id)}/approve`,
      scopes ? { scopes } : {}
    );
  }

  denyPairing(id: string): Promise<IPairing> {
    return this.request('POST', `pairings/${encodeURIComponent(id)}/deny`, {});
  }

  clients(): Promise<IClientList> {
    return this.request('GET', 'clients');
  }

  revokeClient(id: string): Promise<IClient> {
    return this.request('DELETE', `clients/${encodeURIComponent(id)}`);
  }

  // -- webhooks (the owner's only) -------------------------------------------------------------

  webhooks(): Promise<IWebhookEndpointList> {
    return this.request('GET', 'webhooks');
  }

  /** Register an endpoint: the answer holds its signing secret, this once only. */
  createWebhook(url: string, events: WebhookEventType[]): Promise<IWebhookEndpointCreated> {
    return this.request('POST', 'webhooks', { url, events });
  }

  deleteWebhook(id: string): Promise<IWebhookEndpoint> {
    return this.request('DELETE', `webhooks/${encodeURIComponent(id)}`);
  }

  deliveries(
    endpointId: string,
    status: IWebhookDelivery['status'],
    limit = 20
  ): Promise<IWebhookDeliveryList> {
    return this.request(
      'GET',
      `webhooks/${encodeURIComponent(endpointId)}/deliveries?status=${status}&limit=${limit}`
    );
  }

  redeliver(endpointId: string, deliveryId: string): Promise<IWebhookDelivery> {
    return this.request(
      'POST',
      `webhooks/${encodeURIComponent(endpointId)}/deliveries/${encodeURIComponent(deliveryId)}/redeliver`,
      {}
    );
  }
}
