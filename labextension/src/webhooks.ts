/**
 * The sidebar's webhook endpoints (issue 38, the owner's only): the list with each endpoint's
 * delivery counts and its dead letters, adding one (whose signing secret the service shows in
 * that one answer, so it is kept here until the user closes it), deleting, redelivering.
 *
 * Every failed call leaves the server's message in `error` (the list) or `actionError` (what
 * the user did last); the view shows both as text.
 */

import type { LMSPClient } from './api';
import type {
  IWebhookDelivery,
  IWebhookEndpoint,
  IWebhookEndpointCreated,
  WebhookEventType
} from './types';

/** The events an endpoint may ask for, in the order the form offers them. */
export const WEBHOOK_EVENTS: readonly WebhookEventType[] = [
  'response.completed',
  'response.incomplete',
  'response.failed',
  'response.cancelled'
];

/** The newest dead letters listed per endpoint. */
const DEAD_PAGE = 20;

export interface IEndpointView {
  endpoint: IWebhookEndpoint;
  /** Its dead-letter deliveries (newest first), read when its count says it has some. */
  dead: IWebhookDelivery[];
}

function messageOf(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}

export class WebhooksModel {
  data: IEndpointView[] = [];
  loaded = false;
  /** Why the list could not be read (e.g. a paired client's session: owner only). */
  error: string | null = null;
  /** Why the user's last action failed. */
  actionError: string | null = null;
  /** The endpoint just created, with its secret: shown until the user closes it. */
  created: IWebhookEndpointCreated | null = null;
  readonly busy = new Set<string>();

  constructor(
    private readonly client: LMSPClient,
    private readonly emit: () => void
  ) {}

  async refresh(): Promise<void> {
    try {
      const endpoints = (await this.client.webhooks()).data;
      const dead = await Promise.all(
        endpoints.map(e =>
          e.deliveries.dead > 0
            ? this.client.deliveries(e.id, 'dead', DEAD_PAGE).then(page => page.data)
            : Promise.resolve([])
        )
      );
      this.data = endpoints.map((endpoint, i) => ({ endpoint, dead: dead[i] ?? [] }));
      this.error = null;
    } catch (error) {
      this.error = messageOf(error);
    } finally {
      this.loaded = true;
      this.emit();
    }
  }

  /** Register an endpoint; false (and `actionError`) when the service refused it. */
  async add(url: string, events: WebhookEventType[]): Promise<boolean> {
    if (!url.trim()) {
      this.actionError = 'Give the URL the events are sent to.';
      this.emit();
      return false;
    }
    if (!events.length) {
      this.actionError = 'Choose at least one event.';
      this.emit();
      return false;
    }
    return this.act('add', async () => {
      this.created = await this.client.createWebhook(url.trim(), events);
    });
  }

  async remove(endpointId: string): Promise<boolean> {
    return this.act(`delete:${endpointId}`, async () => {
      await this.client.deleteWebhook(endpointId);
      if (this.created?.id === endpointId) {
        this.created = null;
      }
    });
  }

  async redeliver(endpointId: string, deliveryId: string): Promise<boolean> {
    return this.act(`redeliver:${deliveryId}`, async () => {
      await this.client.redeliver(endpointId, deliveryId);
    });
  }

  /** The user has kept the secret: it is not shown again. */
  forgetSecret(): void {
    this.created = null;
    this.emit();
  }

  private async act(key: string, run: () => Promise<void>): Promise<boolean> {
    if (this.busy.has(key)) {
      return false;
    }
    this.busy.add(key);
    this.actionError = null;
    this.emit();
    try {
      await run();
      await this.refresh();
      return true;
    } catch (error) {
      this.actionError = messageOf(error);
      return false;
    } finally {
      this.busy.delete(key);
      this.emit();
    }
  }
}
